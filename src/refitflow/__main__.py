import sys

from refitflow.api.cli import main

sys.exit(main())
