import sys

from gwt_optim.cli import main

sys.exit(main())
