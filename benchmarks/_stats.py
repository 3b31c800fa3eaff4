"""The one table of Student's t the studies' intervals use (``_budget``, ``_paired`` and its plots,
``transfer_finetune``): two-sided 95% quantiles by degrees of freedom."""

from __future__ import annotations

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042}


def t975(df: int) -> float:
    """The quantile at ``df`` >= 1; between the table's rows the row below (the wider interval), past 30 the
    normal's."""
    if df < 1:
        raise ValueError(f"t975: no interval with {df} degrees of freedom")
    return T975.get(df) or (T975[max(k for k in T975 if k <= df)] if df <= 30 else 1.96)
