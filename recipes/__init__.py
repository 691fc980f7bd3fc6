"""Model recipes to train and plan with OSDP: GPT, BERT and T5, written from scratch in torch.

Each recipe is a package with three parts kept apart:

- ``model.py``: the architecture, a plain ``nn.Module`` and its frozen config dataclass;
- ``module.py``: the LightningModule that receives the ``nn.Module`` and defines the loss;
- ``data.py``: the LightningDataModule (byte-level text from the Python installation by default,
  ``data.text_files=...`` for your own).

The Hydra configs that build them live in ``conf/model/`` and ``conf/data/``.
"""
