"""``python -m pyddp.doctor``: runs the doctor (``pyddp.doctor.main``) and exits with its
verdict."""
import sys

from . import main

sys.exit(main())
