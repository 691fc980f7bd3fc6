"""Reporting: the plan and what a run measured, as text, logged hyperparameters and a figure."""
