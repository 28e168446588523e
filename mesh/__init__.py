"""The mesh: the `tandem` command, the mesh file that composes every component's config, `tandem up`, `import-vllm`,
and Envoy's bootstrap rendered from the `envoy/` template. The top layer: it imports the components, none of them
imports it."""
