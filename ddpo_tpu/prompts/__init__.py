"""Where the text prompts of each sampling batch come from: the prompt sets (`sources.py`) and the shipped word
lists (`assets/`). Standard library and numpy only, so the config validation can import it cheaply."""

from ddpo_tpu.prompts.sources import (PROMPT_SETS, PromptError, PromptSource, asset_path, make_prompt_source,
                                      shipped_assets, with_indefinite_article)

__all__ = ["PROMPT_SETS", "PromptError", "PromptSource", "make_prompt_source", "asset_path", "shipped_assets",
           "with_indefinite_article"]
