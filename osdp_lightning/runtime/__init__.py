"""What runs inside the training step and the process: the DDP and split-Linear runtimes the
choices install, collectives, gradient accumulation and clipping, device meshes, guards, errors
every rank can raise, and clean shutdown. The lowest room: it imports no other."""
