"""Answer-scale propose and verify: a small model answers N times, a verifier keeps the answers it can confirm,
compared with one answer of a large model (docs/answers.md).

  normalize.py   figures and dates in text; SQuAD exact match and token F1
  verifiers.py   Verdict, the Verifier protocol: grounded, calculator, unit-tests
  calculator.py  safe arithmetic parser          sandbox.py  untrusted code in a contained process
  code.py        docstring examples -> tests      sampler.py  one prefill, greedy + N samples as one batch
  strategies.py  selection strategies             metrics.py  summary, report, plot from the records
  runner.py      the experiment (`specdraft answers`)
"""
