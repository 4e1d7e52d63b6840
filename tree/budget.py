"""Block-complexity accounting.

Block complexity ``BC = (k + 1) * (1 + sum_i K_i)``: every tree node (the root and the ``sum_i K_i``
draft nodes) is one input of the forward pass, and each brings ``k`` mask inputs with it.  BC is the
budget: the number of inputs of one verification pass.  A budget is never exceeded.
"""

from __future__ import annotations


def block_complexity(tree_size: int, num_masks: int) -> int:
    """Inputs of one pass for a tree of ``tree_size`` nodes (root included) with ``num_masks`` masks
    per node."""
    if tree_size < 1 or num_masks < 0:
        raise ValueError("tree_size must be >= 1 and num_masks >= 0")
    return (num_masks + 1) * tree_size


def min_block_complexity(num_masks: int) -> int:
    """The smallest budget that holds a root and one draft node, each with its masks."""
    return 2 * (num_masks + 1)


def node_budget(budget: int, num_masks: int) -> int:
    """Draft nodes (root excluded) that fit in ``budget`` inputs: ``budget // (k + 1) - 1``.

    Raises ``ValueError`` when not even one draft node fits.
    """
    if num_masks < 0:
        raise ValueError(f"num_masks must be >= 0, got {num_masks}")
    smallest = min_block_complexity(num_masks)
    if budget < smallest:
        raise ValueError(
            f"budget={budget} is too small for num_masks={num_masks}: the smallest tree (a root and "
            f"one draft node, each with {num_masks} mask(s)) needs {smallest} inputs; "
            f"raise budget to at least {smallest} or lower num_masks"
        )
    return budget // (num_masks + 1) - 1
