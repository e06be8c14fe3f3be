import sys

from mpirl.cli import main

sys.exit(main())
