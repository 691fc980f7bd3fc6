"""BERT recipe: bidirectional encoder trained with the masked-language-model objective."""

from recipes.bert.data import BertDataModule
from recipes.bert.model import Bert, BertConfig
from recipes.bert.module import BertLitModule

__all__ = ["Bert", "BertConfig", "BertDataModule", "BertLitModule"]
