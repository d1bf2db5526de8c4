import sys

from mint_cli.main import main

sys.exit(main())
