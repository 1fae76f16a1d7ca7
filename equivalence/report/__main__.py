"""`python -m equivalence.report`: see equivalence/report/divergence.py."""

from equivalence.report.divergence import main

main()
