import sys

from k3.cli import main

sys.exit(main())
