"""Worker for tests/test_doctor.py: runs ``python -m pyddp.doctor`` (its arguments
passed through) in this process, with PYDDP_DOCTOR_FAKE_VERSION set to DOCTOR_FAKE on
the rank named by DOCTOR_FAKE_RANK only, since torchrun gives every rank the same
environment."""
import os
import sys

if os.environ.get("DOCTOR_FAKE_RANK") == os.environ.get("RANK"):
    os.environ["PYDDP_DOCTOR_FAKE_VERSION"] = os.environ["DOCTOR_FAKE"]

from pyddp import doctor  # noqa: E402  (after the override: versions are read at run time)

sys.exit(doctor.main())
