"""The transformers names the Hugging Face tests use, and ``tierckpt.hf``, imported when first used
(tests/_support/lazy.py), so that collecting the tests imports no transformers."""

from __future__ import annotations

from tests._support.lazy import lazy

GPT2Config = lazy("transformers", "GPT2Config")
GPT2LMHeadModel = lazy("transformers", "GPT2LMHeadModel")
Trainer = lazy("transformers", "Trainer")
TrainingArguments = lazy("transformers", "TrainingArguments")
tierhf = lazy("tierckpt.hf")
