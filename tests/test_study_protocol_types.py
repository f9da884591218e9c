"""Every study's runner refuses what is not its protocol type, with the
message written out here by hand (one check, `experiments.protocol.check_protocol`,
serves all five)."""

import pytest

from blocklab import ConfigError
from blocklab.experiments import induction, lr_sensitivity, mup, proxies, real_text
from blocklab.experiments.protocol import check_protocol

CASES = [
    (
        induction.run_induction,
        "run_induction: protocol must be an InductionProtocol (['cpu', 'full', "
        "'quick']), got str.",
    ),
    (
        real_text.run_real_text,
        "run_real_text: protocol must be a RealTextProtocol (['cpu', 'full', "
        "'quick']), got str.",
    ),
    (
        mup.run_study,
        "mup.run_study: protocol must be a MupProtocol (['cpu', 'full', 'quick', "
        "'report']), got str.",
    ),
    (
        lambda p: proxies.run_study(p, ["baseline"]),
        "proxies.run_study: protocol must be a ProxiesProtocol (FULL, CPU, QUICK), "
        "got str.",
    ),
    (
        lr_sensitivity.run_study,
        "run_study: protocol must be an LRProtocol (FULL, CPU, QUICK or "
        "FULL.replace(...)), got str.",
    ),
]


@pytest.mark.parametrize(("run", "message"), CASES)
def test_a_study_refuses_another_type_before_any_work(run, message, plain_python):
    with pytest.raises(ConfigError) as info:
        run("cpu")
    assert str(info.value) == message


def test_check_protocol_passes_its_type_and_its_subclasses(plain_python):
    class Base:
        pass

    class Sub(Base):
        pass

    check_protocol("owner", Sub(), Base, "A, B")
    with pytest.raises(ConfigError, match=r"^owner: protocol must be a Base \(A, B\)"):
        check_protocol("owner", 3, Base, "A, B")
