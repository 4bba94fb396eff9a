import sys

from surefit.cli import main

sys.exit(main())
