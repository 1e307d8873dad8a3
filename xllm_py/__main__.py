import sys

from xllm_py.cli import main

sys.exit(main())
