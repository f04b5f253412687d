"""`python -m benchmarks.engine.doctor_acceptance`: run.main()."""

import sys

from benchmarks.engine.doctor_acceptance.run import main

sys.exit(main())
