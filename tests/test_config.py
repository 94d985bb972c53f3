"""Declarative configs: bounds and choices declared beside each field, checked by the shared conversion for every
algorithm's config; non-finite numbers refused everywhere; the settings table `fglit algorithms NAME` prints."""
import dataclasses
import json
import math
import typing

import pytest

from fglit.cli import main
from fglit.federation import ALGORITHMS, ConfigError, FedConfig, load_algorithms, make_config
from fglit.fl.config import PrivacyConfig, check_settings, describe_config, literal_choices

load_algorithms()
CONFIGS = sorted({a.config for a in ALGORITHMS.values()}, key=lambda c: c.__name__)


def float_fields(cls):
    "The float settings of `cls`, those of its composed configs (privacy) included, by the names `make_config` takes."
    hints = typing.get_type_hints(cls)
    own = [f.name for f in dataclasses.fields(cls) if float in (typing.get_args(hints[f.name]) or (hints[f.name],))]
    parts = [float_fields(hints[f.name]) for f in dataclasses.fields(cls) if dataclasses.is_dataclass(hints[f.name])]
    return own + [n for names in parts for n in names]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_non_finite_numbers_are_refused_in_every_float_setting(cls):
    names = float_fields(cls)
    assert "lr" in names and "dp_clip" in names
    for name in names:
        for bad in (math.nan, math.inf, -math.inf, "nan", "inf"):
            with pytest.raises(ConfigError, match=name):
                make_config(cls, {name: float(bad) if isinstance(bad, str) else bad})


# choices that name the setting they need beside them (each refused without it: tests of their own)
NEEDS = {("OpFGLConfig", "stage_kernel", "c"): {"engine": "stacked"}, ("*", "local_kernel", "c"): {"engine": "stacked"}}


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_choices_are_refused_outside_their_literal(cls):
    choice_fields = [f.name for f in dataclasses.fields(cls) if literal_choices(cls, f.name)]
    assert {"optimizer", "evaluation", "selection", "weighting"} <= set(choice_fields)
    for name in choice_fields:
        with pytest.raises(ConfigError, match=f"{name} must be one of .*; got 'no-such-choice'"):
            make_config(cls, {name: "no-such-choice"})
        for ok in literal_choices(cls, name):
            if ok is not None: assert getattr(make_config(cls, {name: ok, **NEEDS.get((cls.__name__, name, ok), NEEDS.get(("*", name, ok), {}))}), name) == ok


def test_bounds_survive_a_subclass_that_changes_the_default():
    from fglit.algorithms.personalisation import GraphPFLConfig
    assert GraphPFLConfig().rounds == 200 and GraphPFLConfig().selection == "last"
    with pytest.raises(ConfigError, match="rounds must be >= 1 and <= 1000000, got 0"):
        make_config(GraphPFLConfig, {"rounds": 0})
    with pytest.raises(ConfigError, match="rounds must be >= 1 and <= 1000000, got 99999999999999999999"):
        make_config(GraphPFLConfig, {"rounds": 99999999999999999999})
    with pytest.raises(ConfigError, match="selection must be one of best_val, last"):
        make_config(GraphPFLConfig, {"selection": "best"})
    with pytest.raises(ConfigError, match=r"dropout must be >= 0 and < 1, got 1.0"):
        make_config(ALGORITHMS["fedpg"].config, {"dropout": 1.0})


def test_a_config_built_directly_is_checked_by_validate():
    config = FedConfig(lr=float("nan"))
    with pytest.raises(ConfigError, match="lr must be a finite number"):
        config.validate()
    with pytest.raises(ConfigError, match="client_fraction must be > 0 and <= 1"):
        check_settings(FedConfig(client_fraction=1.5))
    with pytest.raises(ConfigError, match="optimizer must be one of adam, sgd"):
        FedConfig(optimizer="rmsprop").validate()


@pytest.mark.parametrize("name", ["fedavg", "opfgl", "gpfl", "fedpg", "fedgls"])
def test_settings_table_has_every_field(name):
    cls = ALGORITHMS[name].config
    table = describe_config(cls)
    assert table.setting.tolist() == [f.name for f in dataclasses.fields(cls) if f.name != "privacy"] + \
        [f.name for f in dataclasses.fields(PrivacyConfig)]
    assert set(table[table.group == "privacy"].setting) == {f.name for f in dataclasses.fields(PrivacyConfig)}
    shared = table[table.setting.isin([f.name for f in dataclasses.fields(FedConfig)] + [f.name for f in dataclasses.fields(PrivacyConfig)])]
    assert (shared.meaning != "").all()                        # every shared setting says what it means
    row = table.set_index("setting").loc["client_fraction"]
    assert row.allowed == "> 0 and <= 1" and row.type == "float"
    assert table.set_index("setting").loc["optimizer"].allowed == "adam, sgd"


def test_cli_algorithms(capsys):
    assert main(["algorithms", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["algorithm"] for r in rows} == set(ALGORITHMS)
    assert next(r for r in rows if r["algorithm"] == "gpfl")["tasks"] == "graph"
    secure = {r["algorithm"]: r["secure_aggregation"] for r in rows}
    assert (secure["fedavg"], secure["gcfl"], secure["fedpg"]) == ("yes", "no", "with upload=class_sums only")
    assert main(["algorithms", "fedprox", "--json"]) == 0
    settings = {r["setting"]: r for r in json.loads(capsys.readouterr().out)}
    assert settings["mu"]["default"] == 0.01 and settings["lr"]["allowed"] == "> 0 and <= 10"
    assert main(["algorithms", "fedproxx"]) == 2
    assert "unknown algorithm 'fedproxx'" in capsys.readouterr().err


def test_secure_aggregation_dropout_flag_cannot_be_mistaken_for_model_dropout(shared_root, capsys):
    with pytest.raises(SystemExit):                             # the old, ambiguous flag is gone
        main(["run", "fedavg", "--dataset", "Cora", "--dropout", "0.2"])
    capsys.readouterr()
    code = main(["run", "fedavg", "--dataset", "Cora", "--clients", "4", "--rounds", "1", "--local-epochs", "1", "--quiet",
                 "--json", "--root", str(shared_root), "--secure-aggregation", "--secagg-dropout", "0.25"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["config"]["privacy"]["secagg_dropout"] == 0.25 and summary["config"]["dropout"] == 0.5


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_config_signature_evaluates(cls):
    "What `show_doc` and `inspect.signature(..., eval_str=True)` do: inherited `Literal` fields resolve in any module."
    import inspect
    params = inspect.signature(cls, eval_str=True).parameters
    assert typing.get_origin(params["optimizer"].annotation) is typing.Literal


def test_a_config_from_a_module_without_literal_still_converts():
    "A subclass defined where `Literal` is not imported (a notebook re-registering an algorithm, say): its string annotations still resolve."
    import types
    module = types.ModuleType("no_literal_here")
    sys_modules = __import__("sys").modules
    sys_modules["no_literal_here"] = module
    try:
        exec("from __future__ import annotations\nfrom dataclasses import dataclass\nfrom fglit.fl.config import FedConfig\n"
             "@dataclass\nclass Mine(FedConfig):\n    mode: Literal['a', 'b'] = 'a'\n", module.__dict__)
        assert make_config(module.Mine, {"mode": "b", "optimizer": "sgd"}).mode == "b"
        with pytest.raises(ConfigError, match="mode must be one of a, b"):
            make_config(module.Mine, {"mode": "c"})
    finally:
        del sys_modules["no_literal_here"]


def test_privacy_settings_are_one_composed_config():
    "Every algorithm's privacy settings live in one `PrivacyConfig`; flat, dotted and mapping forms build the same config."
    from fglit.federation import make_config
    for cls in CONFIGS:
        names = {f.name for f in dataclasses.fields(cls)}
        assert "privacy" in names and not names & {f.name for f in dataclasses.fields(PrivacyConfig)}
    cls = ALGORITHMS["fedavg"].config
    flat = make_config(cls, {"dp_noise": 0.5, "secure_aggregation": True, "lr": 0.1})
    dotted = make_config(cls, {"privacy.dp_noise": 0.5, "privacy.secure_aggregation": "true", "lr": 0.1})
    mapping = make_config(cls, {"privacy": {"dp_noise": 0.5, "secure_aggregation": True}, "lr": 0.1})
    assert flat == dotted == mapping and flat.privacy == PrivacyConfig(secure_aggregation=True, dp_noise=0.5)
    assert make_config(cls, dataclasses.asdict(flat)) == flat                 # what a result's config holds, read back
    with pytest.raises(ConfigError, match="unknown setting 'noise' for PrivacyConfig"):
        make_config(cls, {"privacy.noise": 1.0})
    with pytest.raises(ConfigError, match="dp_noise must be a finite number"):
        make_config(cls, {"dp_noise": float("nan")})
    with pytest.raises(ConfigError, match="secagg_dropout and secagg_dropout_before need secure_aggregation=True"):
        make_config(cls, {"privacy": {"secagg_dropout": 0.1}})
