"""Applying a plan to a model with FSDP2: each unit's choice installed, in the order FSDP2 needs."""
