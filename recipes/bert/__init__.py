"""BERT recipe: bidirectional encoder trained with the masked-language-model objective."""

from osdp_lightning.recipes.bert.data import BertDataModule
from osdp_lightning.recipes.bert.model import Bert, BertConfig
from osdp_lightning.recipes.bert.module import BertLitModule

__all__ = ["Bert", "BertConfig", "BertDataModule", "BertLitModule"]
