"""The project's studies (not shipped in the wheel): what they train and measure, their runners
(``python -m studies.<runner>`` from the repository root) and their bookkeeping.

- :mod:`studies.records`: the shared command line, records saved as runs finish, sweep choices,
  spreads over seeds as the pages show them.
- :mod:`studies.lm`, run by :mod:`studies.lm_study` and :mod:`studies.lm_extrapolation`:
  language modelling on the standard library's source (``docs/results_lm*.md``).
- :mod:`studies.synthetic`, run by :mod:`studies.synthetic_recall`: MQAR and S-NIAH
  (``docs/results.md``).

The measures they call that a user may call too live in :mod:`trellis_lm.eval`.
"""
