"""Shared test configuration: float64 available, fast deterministic keys."""

import jax
import pytest

jax.config.update("jax_enable_x64", True)


@pytest.fixture
def key():
    return jax.random.key(0)


#: Tests that take 15 s or more on a 2-core machine and whose property is
#: also covered, at smaller size, by a test of the default suite. They run
#: with `python3 -m pytest -m slow` (the default run, `-m "not slow"` in
#: pyproject.toml, stays within CI's 15-minute budget).
SLOW = (
    "tests/test_notebooks_and_examples.py::test_notebook_runs[03_signal_propagation.ipynb]",
    "tests/test_cli_signal.py::test_report_section_links_its_figures",
    "tests/test_sweep.py::test_train_seeds_of_the_train_command_equal_train_one",
    "tests/test_sweep.py::test_probe_is_recorded_at_init_and_after_every_chunk",
    "tests/test_moe.py::test_moe_forward_and_loss_on_a_charlm",
    "tests/test_batched.py::test_charlm_batched_logits_and_loss_gradients_equal_vmapped_ones",
    "tests/test_batched.py::test_batched_block_gradients_equal_vmapped_ones",
    "tests/test_batched.py::test_batched_stack_equals_vmap_and_unroll_changes_nothing",
    "tests/test_cli_train.py::test_json_output_and_png",
    "tests/test_cli_train.py::test_report_section",
    "tests/test_cli_check.py::test_identity_rows_all_hold",
    "tests/test_cli_signal.py::test_table_lists_each_placement_with_the_chapter_columns",
    "tests/test_experiments_studies.py::test_compare_activations_tiny_run_starts_at_log_28",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid in SLOW:
            item.add_marker(pytest.mark.slow)
