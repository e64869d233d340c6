"""What every real-size recipe under examples/configs/ must show against the model it stands for: the
parameter counts of transformers' model of the published config.json (the caller counts them its family's
way), the dry run printing them, and that config.json read by the family's Hugging Face adapter giving
the recipe's shapes."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from megacann.config import MegacannConfig, load_config
from megacann.config.families import shape_keys
from megacann.models import prepare_model_config

RECIPES = Path(__file__).resolve().parents[1] / "examples" / "configs"


def check_recipe_matches_published(
    tmp_path: Path, recipe: str, published: dict, total: int, active: int
) -> tuple[MegacannConfig, object]:
    """``recipe`` (relative to examples/configs) counts ``total`` parameters, ``active`` per token, says
    so in the dry run, and has the shapes ``published`` gives; returns (the recipe's configuration, the
    model configuration read from ``published``) for the family's own checks."""
    from megacann.dry_run import describe

    cfg = load_config(str(RECIPES / recipe))
    spec = prepare_model_config(cfg)
    assert (spec.total_parameters(cfg.model), spec.parameters_per_token(cfg.model)) == (total, active)
    text = describe(cfg, recipe)
    assert f"{cfg.model.type}: {total:,} parameters" in text
    assert (f"active per token: {active:,} parameters" in text) == (active != total)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": cfg.model.type, **published}))
    from_hf = spec.hf.config_from_hf(str(tmp_path / "config.json"))
    prepare_model_config(dataclasses.replace(cfg, model=from_hf), spec)
    keys = [k for k in shape_keys(cfg.model) if k != "make_vocab_size_divisible_by"]
    assert {k: getattr(from_hf, k) for k in keys} == {k: getattr(cfg.model, k) for k in keys}
    return cfg, from_hf
