"""The Lightning integration: the Trainer and Fabric strategies, the setup they share, their
configuration, callbacks, and every private Lightning API osdp uses (lightning_compat)."""
