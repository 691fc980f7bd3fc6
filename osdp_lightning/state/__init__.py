"""State on disk: sharded checkpoints and their canonical names, resuming, pretrained weights
read into a sharded model, and export to a Hugging Face directory."""
