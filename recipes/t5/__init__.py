"""T5 recipe: encoder-decoder with relative position bias, span corruption or generated seq2seq tasks."""

from osdp_lightning.recipes.t5.data import T5SpanCorruptionDataModule
from osdp_lightning.recipes.t5.model import T5, T5Config
from osdp_lightning.recipes.t5.module import T5LitModule
from osdp_lightning.recipes.t5.tasks import T5TaskDataModule

__all__ = ["T5", "T5Config", "T5LitModule", "T5SpanCorruptionDataModule", "T5TaskDataModule"]
