"""How scores become attention outputs. This package's face runs nothing: importing one of its floors (the
fused-term contract :mod:`.terms`, the compute choices :mod:`.choices`, the kernels :mod:`.triton`) loads that floor
alone, never the dispatcher above them; callers import what they use from its modules.

* :mod:`.dispatch`: :func:`~.dispatch.scored_attention`, the one entry of the scorers' attention;
  :func:`~.dispatch.resolve_impl`, the one place that turns the ``impl`` choice and a call into a path of
  :data:`~.dispatch.PATHS`; :func:`~.dispatch.check_impl`, the patch-time check of a choice.
* the paths: :mod:`.reference` (the oracle), :mod:`.chunked`, :mod:`.blockwise`, :mod:`.triton`;
* what they share: :mod:`.masks`, :mod:`.grouped`, :mod:`.dropout`, :mod:`.terms`, :mod:`.choices`;
* :mod:`.sequences`: a call split into its sequences (a padded batch's rows, a packed call's spans), and
  :mod:`.packed`, how a packed call (continuous batching) lays them out.
"""
