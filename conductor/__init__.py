"""conductor"""
