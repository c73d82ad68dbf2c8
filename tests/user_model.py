"""A model of a user's own, for --model tests.user_model:build (tests/test_weights.py): importable
on the Ray workers as on the driver, because Ray puts the driver's working directory (the
repository root, where pytest runs) on their path."""

from __future__ import annotations

import torch


def build(num_classes: int) -> torch.nn.Module:
    """A small convnet with a head of num_classes logits."""
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(8, num_classes),
    )


def wrong_head(num_classes: int) -> torch.nn.Module:
    """A model whose head ignores num_classes: refused before Ray."""
    return build(7)


NOT_A_FUNCTION = 3
