"""Quantizers of the release: block FP8 (:mod:`drafter.quant.fp8`), its independent reference
(:mod:`drafter.quant.reference`), the release self-check (:mod:`drafter.quant.verify`), the FP8 drop-in
(:mod:`drafter.quant.dropin`), and EXL3 (:mod:`drafter.quant.exl3`)."""
