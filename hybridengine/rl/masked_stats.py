"""Masked statistics on padded ``[B, R]`` tensors (a leaf module: imports nothing from the package).

The ``mask`` is 1 on the elements to count and 0 elsewhere (padding, tool/observation tokens);
values at masked-out positions never reach a result, not even NaN or inf. Used by the advantage
estimators (``advantages``), the KL penalty and controllers (``kl``), the policy/value losses and
the metrics. Semantics follow verl's ``torch_functional`` (masked_mean of an empty mask is 0,
masked_var is Bessel-corrected by default). metrics_as_floats reads such statistics, kept on the
device, back in one transfer.
"""

import torch

Tensor = torch.Tensor


def masked_sum(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    """Sum of ``values`` where ``mask`` is set; NaN/inf at masked-out positions are ignored."""
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if axis is None else kept.sum(dim=axis)


def masked_mean(values: Tensor, mask: Tensor, axis: int | None = None) -> Tensor:
    """Mean over the masked elements; 0 where the mask is empty (verl returns 0 there too)."""
    count = mask.to(values.dtype)
    count = count.sum() if axis is None else count.sum(dim=axis)
    return masked_sum(values, mask, axis) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance over all masked elements (Bessel-corrected by default, as verl)."""
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        count = int(mask.bool().sum())
        if count < 2:
            raise ValueError(f"masked_var: unbiased variance needs >= 2 masked elements, got {count}")
        variance = variance * (count / (count - 1))
    return variance


def masked_whiten(values: Tensor, mask: Tensor, shift_mean: bool = True) -> Tensor:
    """(values - mean) / sqrt(var + 1e-8) with mean/var over the masked elements."""
    mean, var = masked_mean(values, mask), masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    return whitened if shift_mean else whitened + mean


def check_shapes(**tensors: Tensor) -> None:
    """Raise unless every tensor is 2-D ``[B, R]`` with one shared shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 2:
        raise ValueError(f"expected equal [B, R] shapes, got {shapes}")


def metrics_as_floats(means: dict) -> dict:
    """`means` as floats, the device tensors among them read in one transfer (one host sync
    for a whole update, not one per optimizer step or per statistic)."""
    on_device = [k for k, v in means.items() if isinstance(v, torch.Tensor)]
    if on_device:
        values = torch.stack([means[k] for k in on_device]).tolist()
        means.update(zip(on_device, values))
    return means
