"""Random recipes, random overrides and random YAML text (hypothesis): whatever a user writes, preparing the
run (loading, validation, the model family's and pipeline's rules, the input checks, the dry run) either
succeeds or fails with a megacann error carrying a message, never with a raw exception from deep inside."""

import copy
import io
import typing

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from training_helpers import TINY_MODEL

from megacann.config import (
    CHOICES,
    ConfigError,
    MegacannConfig,
    all_dotted_keys,
    apply_overrides,
    config_from_dict,
    load_config,
)
from megacann.dry_run import print_dry_run
from megacann.errors import MegacannError
from megacann.training.preflight import preflight
from megacann.training.recipe import prepare_recipe

# a valid recipe the fuzz changes: the training tests' tiny LLaMA (with the default vocabulary padding)
BASE = {
    "experiment": {"name": "fuzz", "output_dir": "/nonexistent-megacann-fuzz/run"},
    "model": {**{k: v for k, v in TINY_MODEL.items() if k != "make_vocab_size_divisible_by"}, "vocab_size": 300},
    "data": {"seq_length": 32, "batch_size": 2, "tokenizer": "byte"},
    "optim": {"max_steps": 10},
    "distributed": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
}
KEYS = all_dotted_keys() + ["optim.learning_rat", "model.hiden_size", "bogus", "distributed", "model.type.x"]
CHOICE_VALUES = [v for values in CHOICES.values() for v in values]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 10),
    st.integers(-(2**40), 2**40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(CHOICE_VALUES + ["byte", "1,1,1", "0,0,0", "[1, 2]", "{}"]),
)
values = st.one_of(
    scalars,
    st.lists(st.one_of(st.integers(-2, 8), st.text(max_size=3), st.floats(-1, 2)), max_size=4),
    st.dictionaries(st.sampled_from(["rope_type", "factor", "a", ""]), scalars, max_size=3),
)


def _field_type(key: str):
    section, _, leaf = key.rpartition(".")
    owner = type(getattr(MegacannConfig(), section, None)) if section else MegacannConfig
    return typing.get_type_hints(owner).get(leaf) if owner is not type(None) else None


def plausible(key: str) -> st.SearchStrategy:
    """Values of the key's own type, small (so the recipe gets past the type checks to the deeper rules)."""
    tp = _field_type(key)
    options = [st.none()] if type(None) in typing.get_args(tp) else []
    kinds = set(typing.get_args(tp)) | {tp}
    if int in kinds:
        options.append(st.integers(-1, 16))
    if float in kinds:
        options.append(st.floats(-1.0, 4.0) | st.sampled_from([0.0, 1.0, float("nan"), float("inf")]))
    if bool in kinds:
        options.append(st.booleans())
    if str in kinds:
        options.append(st.sampled_from([*CHOICES.get(key, ()), "byte", "", "x"]))
    if list in kinds:
        options.append(st.lists(st.integers(-1, 6), max_size=4))
    if dict in kinds:
        options.append(st.dictionaries(st.sampled_from(["rope_type", "factor"]), scalars, max_size=2))
    return st.one_of(options) if options else values


def prepare(cfg, world_size) -> None:
    """Everything that runs before the first rank would start (the launcher's path), and the dry run."""
    prepare_recipe(cfg, world_size=world_size)
    preflight(cfg, None, create=False)
    print_dry_run(cfg, out=io.StringIO())


def _check(action) -> None:
    try:
        action()
    except MegacannError as err:
        assert str(err).strip(), f"{type(err).__name__} without a message"
        event(f"refused: {type(err).__name__}")
    else:
        event("prepared")


def _apply(raw: dict, key: str, value) -> dict:
    raw = copy.deepcopy(raw)
    if "." not in key:
        raw[key] = value
        return raw
    section, leaf = key.split(".", 1)
    if not isinstance(raw.get(section), dict):
        raw[section] = {}
    raw[section][leaf] = value
    return raw


# derandomized: the same sweep on every run (a failure reproduces); no example database in the checkout
FUZZ = settings(
    max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
)
# the README suite's share of the recipe and override sweeps; the extended tier runs 300 more of each (a
# derandomized sweep's examples follow from the test's name, so the extended tests draw other ones)
FUZZ_SHORT = settings(FUZZ, max_examples=60)
FUZZ_LONG = settings(FUZZ, max_examples=300)


CHANGES = st.sampled_from(KEYS).flatmap(lambda key: st.tuples(st.just(key), plausible(key) | values))
RECIPES = (st.lists(CHANGES, min_size=1, max_size=4), st.sampled_from([None, 4, 8, 6]))
OVERRIDES = st.lists(
    st.one_of(
        st.tuples(st.sampled_from(KEYS), st.text(max_size=8)).map("=".join),
        st.tuples(st.sampled_from(KEYS), values.map(repr)).map("=".join),
        st.text(max_size=12),
    ),
    max_size=4,
)


def _random_recipe(changes, world_size) -> None:
    raw = BASE
    for key, value in changes:
        raw = _apply(raw, key, value)
    _check(lambda: prepare(config_from_dict(raw, source="fuzz.yaml"), world_size))


def _random_overrides(overrides) -> None:
    def action():
        cfg = config_from_dict(copy.deepcopy(BASE), source="fuzz.yaml")
        apply_overrides(cfg, overrides)
        prepare(cfg, 4)

    _check(action)


@FUZZ_SHORT
@given(*RECIPES)
def test_random_recipes_fail_only_with_megacann_errors(changes, world_size):
    _random_recipe(changes, world_size)


@pytest.mark.extended
@FUZZ_LONG
@given(*RECIPES)
def test_more_random_recipes_fail_only_with_megacann_errors(changes, world_size):
    _random_recipe(changes, world_size)


@FUZZ_SHORT
@given(OVERRIDES)
def test_random_overrides_fail_only_with_megacann_errors(overrides):
    _random_overrides(overrides)


@pytest.mark.extended
@FUZZ_LONG
@given(OVERRIDES)
def test_more_random_overrides_fail_only_with_megacann_errors(overrides):
    _random_overrides(overrides)


@FUZZ
@given(st.text(alphabet=st.sampled_from(list("ab:{}[],- \n\t'\"#&*!|>%@`0.5e")), max_size=60))
def test_random_yaml_text_fails_only_with_megacann_errors(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("yaml") / "recipe.yaml"
    path.write_text(text)
    _check(lambda: load_config(str(path)))


def test_the_sweep_starts_from_a_recipe_that_prepares():
    prepare(config_from_dict(copy.deepcopy(BASE)), 4)  # so the random changes are what fails
    with pytest.raises(ConfigError, match="model.hidden_size: expected int"):
        prepare(config_from_dict(_apply(BASE, "model.hidden_size", "wide")), 4)
