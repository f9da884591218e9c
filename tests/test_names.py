"""One meaning per name: a name means one thing across the package (a count is
`num_*`, a list is the plural; a registry of objects and a list of their names
are two names; a function and a module are two names). The renamed keywords of
0.2 are gone (tests/test_removed_paths.py)."""

import inspect

import blocklab as bl
from blocklab.diagnostics import theory


def test_no_public_function_takes_num_blocks_any_more():
    for name in theory.__all__:
        fn = getattr(theory, name)
        if callable(fn) and not isinstance(fn, type):
            assert "num_blocks" not in inspect.signature(fn).parameters, name


def test_study_registry_and_study_names_are_two_names():
    """`STUDIES` is the registry of `Study` objects; `STUDY_NAMES` their names,
    in the report's order, derived from it (one source of truth)."""
    from blocklab.cli.commands import REPORT_SECTIONS
    from blocklab.experiments import protocol

    assert all(isinstance(s, protocol.Study) for s in protocol.STUDIES)
    assert protocol.STUDY_NAMES == tuple(s.name for s in protocol.STUDIES)
    assert bl.experiments.STUDY_NAMES == protocol.STUDY_NAMES == REPORT_SECTIONS
    assert all(isinstance(n, str) for n in bl.experiments.STUDY_NAMES)
    assert not hasattr(bl.experiments, "STUDIES")  # the old list of module names


def test_every_study_module_loads_from_its_registry_entry():
    from blocklab.experiments import protocol

    for s in protocol.STUDIES:
        assert s.module.__name__ == f"blocklab.experiments.{s.module_name}"
        assert getattr(bl.experiments, s.module_name) is s.module
        assert callable(s.module.report_section), s.name


def test_census_is_a_function_and_parameter_census_the_study_module():
    from blocklab.experiments import parameter_census
    from blocklab.experiments.protocol import study

    assert callable(bl.census) and not inspect.ismodule(bl.census)
    assert study("census").module is parameter_census
    assert not hasattr(bl.experiments, "census")


def test_gated_acts_is_the_tuple_of_nn_and_the_hf_map_has_its_own_name():
    from blocklab.interop import hf_common
    from blocklab.nn import config

    assert isinstance(config.GATED_ACTS, tuple)
    assert not hasattr(hf_common, "GATED_ACTS")
    assert hf_common.HF_ACT_TO_GATED["silu"] == "swiglu"
    assert set(hf_common.HF_ACT_TO_GATED.values()) <= set(config.GATED_ACTS)
