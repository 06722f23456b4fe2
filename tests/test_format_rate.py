"""Throughput to three significant figures (issue 45, "every flag means one thing"): two
plans whose rates differ print apart, whatever their size."""

from __future__ import annotations

import pytest

from mpsim.views.text import format_rate, format_rate_band


@pytest.mark.parametrize(("per_s", "shown"), [(0.0912, "0.0912"), (0.09, "0.0900"), (7.28, "7.28"), (12.34, "12.3"),
                                               (123.4, "123"), (1234.4, "1234"), (0.000123456, "0.000123"),
                                               (9.996, "10.0"), (99.96, "100"), (0.0, "0")])
def test_a_rate_shows_three_significant_figures(per_s, shown):
    assert format_rate(per_s) == shown


def test_rates_that_printed_alike_at_two_decimals_print_apart():
    """0.0912 and 0.0874 samples/s both printed as 0.09."""
    assert f"{0.0912:.2f}" == f"{0.0874:.2f}"
    assert format_rate(0.0912) != format_rate(0.0874)


def test_the_band_takes_the_rates_decimals():
    assert format_rate_band(7.2812, 0.3612) == "7.28 ± 0.36"
    assert format_rate_band(0.0912, 0.0046) == "0.0912 ± 0.0046"
    assert format_rate_band(1234.4, 61.7) == "1234 ± 62"
