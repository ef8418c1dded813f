"""Whatever data or bytes come in, the config either builds (and then round-trips through
`to_dict`) or raises `ConfigError`; no other exception escapes."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lifecycle.config import LifecycleConfig
from lifecycle.errors import ConfigError

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.binary(max_size=8),
)
KEYS = st.one_of(st.text(max_size=12), st.integers(), st.none(), st.booleans())
ANYTHING = st.recursive(
    SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3), max_leaves=6
)
PLAUSIBLE = st.sampled_from([
    None, True, False, 0, 1, 3, 63, 64, 4096, -1, 2**40, 2**70, 0.5, 12.0, 604800.0, 1e9, math.inf, math.nan,
    "", "/ckpt", "rel/dir", "a\x00b", "..", "actor", "critic.v2", "-x", "hf", "mbridge", "dist_ckpt", "torch_dcp",
    "model", "optimizer", "extra", "hf_model", "auto", "path", "disable", "fallback", "refuse", "gloo", "nccl",
    "pkg.mod:Engine", "float16", "streamed", "atomic", [], ["model"], ["model", "optimizer"], ["actor", "critic"],
    ["..", "x"], ["actor", "actor"], {}, [{}],
])
"""Values near the edges of what some key takes."""
PATHS = [None, "/ckpt", "rel/dir", "/ckpt/global_step_7"]
FORMATS = [None, "hf", "mbridge", "dist_ckpt", "torch_dcp"]
BOOLS = [True, False, None]
VALID: dict[str, list[Any]] = {
    "root": PATHS, "path": PATHS, "profile_dir": PATHS, "format": FORMATS,
    "roles": [[], ["actor"], ["actor", "critic.v2", "ref-1"]], "keep_last": [None, 1, 3, 10**18],
    "fsync": BOOLS, "tracker": BOOLS, "verify": BOOLS, "async": BOOLS, "strict": BOOLS, "profile": BOOLS,
    "use_dist_checkpointing": BOOLS, "use_mbridge": BOOLS,
    "contents": [["model"], ["model", "optimizer", "extra"], ["model", "hf_model"]],
    "mode": ["auto", "disable", "path"], "on_damaged": ["fallback", "refuse"],
    "backend": ["auto", "gloo", "shm", "pkg.mod:Engine"], "bucket_bytes": [64, 4096, 2**31, 2**40],
    "apply": ["atomic", "streamed"], "timeout_s": [0.001, 12, 300.0, 604800.0],
    "rollout_dtype": [None, "float32", "bfloat16"], "max_shard_bytes": [1, 4096, 5 * 1024**3],
    **{f"{trigger}_s": [None, 0.001, 120.0, 604800.0]
       for trigger in ("init_load", "train_step", "save", "sync_weights", "resume", "close", "receive_weights",
                       "generate")},
}
"""Values each key takes, so that many examples build and the round trip is exercised."""


def _template() -> dict[str, Any]:
    """Every real key, nested as in the config, including the deprecated ones `to_dict` drops
    and the default format's own option, which it dumps only when set."""
    tree = LifecycleConfig().to_dict()
    tree["checkpoint"].update(use_dist_checkpointing=None, use_mbridge=None)
    tree["checkpoint"]["save"].update(max_shard_bytes=None)
    return tree


def _value(key: str) -> st.SearchStrategy[Any]:
    valid = st.sampled_from(VALID[key])
    return st.one_of(*[valid] * 8, PLAUSIBLE, ANYTHING)


def _config_like(template: dict[str, Any], stray: bool) -> st.SearchStrategy[dict[Any, Any]]:
    """Some of the real keys at every level, each with a valid, plausible or arbitrary value,
    and with `stray` one more key of any kind at each level."""
    optional = {
        key: _config_like(default, stray) if isinstance(default, dict) else _value(key)
        for key, default in template.items()
    }
    known = st.fixed_dictionaries({}, optional=optional)
    if not stray:
        return known
    return st.builds(lambda k, s: {**s, **k}, known, st.dictionaries(KEYS, ANYTHING, max_size=1))


def test_every_real_key_has_valid_samples() -> None:
    def leaves(tree: dict[str, Any]) -> set[str]:
        return set().union(*(leaves(v) if isinstance(v, dict) else {k} for k, v in tree.items()))

    assert leaves(_template()) == set(VALID)


CLEAN = _config_like(_template(), stray=False)
DATA = st.one_of(CLEAN, CLEAN, CLEAN, CLEAN, _config_like(_template(), stray=True), ANYTHING)


def _outcome(build: Any) -> LifecycleConfig | ConfigError:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            return build()
        except ConfigError as exc:
            assert isinstance(exc.key, str)
            assert not exc.key or str(exc).startswith(f"{exc.key}: ")
            return exc


def _assert_round_trips(cfg: LifecycleConfig) -> None:
    dumped = cfg.to_dict()
    assert LifecycleConfig.from_dict(dumped) == cfg
    assert json.loads(json.dumps(dumped)) == dumped


@FUZZ
@given(DATA)
def test_any_data_builds_a_config_that_round_trips_or_raises_config_error(data: Any) -> None:
    outcome = _outcome(lambda: LifecycleConfig.from_dict(data))
    if isinstance(outcome, LifecycleConfig):
        _assert_round_trips(outcome)


@pytest.fixture(scope="module")
def yaml_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "lifecycle.yaml"


YAMLISH = st.text(alphabet=st.sampled_from(list("[]{}:-,'\"!&*#|>?%@`\\ \n\t0123456789.exabkly_")), max_size=200)
"""Text made of YAML's punctuation, digits and a few letters, to reach the parser's corners
(tags, anchors, dates, hex and exponent numbers) more often than random bytes do."""


@FUZZ
@given(st.one_of(st.binary(max_size=200), YAMLISH.map(str.encode), st.text(max_size=100).map(str.encode)))
def test_any_bytes_in_a_yaml_file_build_a_config_or_raise_config_error(yaml_path: Path, content: bytes) -> None:
    yaml_path.write_bytes(content)
    outcome = _outcome(lambda: LifecycleConfig.from_yaml(yaml_path))
    if isinstance(outcome, LifecycleConfig):
        _assert_round_trips(outcome)


@FUZZ
@given(DATA)
def test_data_written_as_yaml_builds_the_same_config_as_the_data(yaml_path: Path, data: Any) -> None:
    yaml_path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    from_yaml = _outcome(lambda: LifecycleConfig.from_yaml(yaml_path))
    from_dict = _outcome(lambda: LifecycleConfig.from_dict(data))
    if isinstance(from_dict, LifecycleConfig):
        assert from_yaml == from_dict
    else:
        assert isinstance(from_yaml, ConfigError)
        # the same key, except at the top level, where a file has no key and names itself
        assert from_yaml.key == (from_dict.key or str(yaml_path)), (from_yaml, from_dict)
