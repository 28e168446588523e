"""simengine"""
