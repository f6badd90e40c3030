"""Offline calibration (K/V amax -> scales), layer-wise sensitivity analysis and policy selection.

Modules: :mod:`kv_hooks` (fake-quantized K/V inside a transformers forward), :mod:`data` (text ->
token windows), :mod:`modeling` (load a model, its geometry and config hash), :mod:`scales`
(calibrate), :mod:`metrics` (KL / NLL against a reference), :mod:`sensitivity` (analyze),
:mod:`selection` (select under a byte budget), :mod:`report` (plots and markdown).
"""
