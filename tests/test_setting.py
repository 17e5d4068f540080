"""mars.decoding.setting: one row's decoding setting, its checks and the window slots a step reads for it."""

from __future__ import annotations

import pytest

from mars.decoding.setting import Setting
from mars.errors import ConfigError

B = 4


@pytest.mark.parametrize("kwargs,message", [
    (dict(tau=0.0), r"^tau: must be in \(0, 1\], got 0\.0$"),
    (dict(tau=1.5), r"^tau: must be in \(0, 1\]"),
    (dict(tau=float("nan")), r"^tau: must be in \(0, 1\]"),
    (dict(tau=True), r"^tau: must be in \(0, 1\], got True"),
    (dict(tau="0.9"), r"^tau: must be in \(0, 1\], got '0\.9'"),
    (dict(tau=0.9, lossless=True), r"^tau: the lossless mode decodes greedily"),
    (dict(width=0), r"^block_size: must be an integer >= 1, got 0$"),
    (dict(width=2.0), r"^block_size: must be an integer >= 1"),
    (dict(width=True), r"^block_size: must be an integer >= 1"),
])
def test_a_bad_setting_is_an_error_naming_its_key(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Setting(**kwargs)


def test_a_tau_is_checked_under_the_key_its_caller_names():
    assert Setting.check_tau(1) == 1.0 and isinstance(Setting(1).tau, float)
    with pytest.raises(ConfigError, match=r"^taus: must be in \(0, 1\], got 2$"):
        Setting.check_tau(2, "taus")


def test_slots_a_step_reads():
    # tau = 1: greedy AR, no masks, the last token only
    assert Setting().slots(B) == 1 and not Setting().needs_masks(B)
    # tau < 1: the last token and w - 1 masks; lossless: the last token, w - 1 drafts and w - 1 masks
    assert Setting(0.9).slots(B) == B and Setting(lossless=True).slots(B) == 2 * B - 1
    # a narrow width w < B decodes as at block size w, and w = 1 is AR again
    assert Setting(0.9, width=2).slots(B) == 2 and Setting(lossless=True, width=2).slots(B) == 3
    assert Setting(0.9, width=1).slots(B) == 1 and not Setting(lossless=True, width=1).needs_masks(B)
    # a width above the batch's B decodes at B; a batch of B = 1 reads one slot whatever the setting
    assert Setting(0.9, width=8).at(B) == B and Setting(0.9, width=8).slots(B) == B
    assert Setting(0.5).slots(1) == Setting(lossless=True).slots(1) == 1
