import sys

from distckpt.tools.cli import main

sys.exit(main())
