"""Where the text prompts of each sampling batch come from: the prompt sets (`sources.py`), the shipped word
lists (`assets/`) and the references' prompt datasets with their metadata (`datasets.py`). Standard library and
numpy only, so the config validation can import it cheaply."""

from ddpo_tpu.prompts.sources import (PROMPT_SETS, PromptError, PromptSource, asset_path, make_prompt_source,
                                      shipped_assets, source_from_config, with_indefinite_article)
from ddpo_tpu.prompts.datasets import DatasetSource, EditDatasetSource, read_dataset

__all__ = ["PROMPT_SETS", "DatasetSource", "EditDatasetSource", "PromptError", "PromptSource", "make_prompt_source",
           "read_dataset", "source_from_config", "asset_path", "shipped_assets", "with_indefinite_article"]
