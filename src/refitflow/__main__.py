import sys

from refitflow.cli.main import main

sys.exit(main())
