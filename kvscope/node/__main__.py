"""`python -m kvscope.node`: the agent daemon that `kvscope agent` execs into (see
`kvscope.node.daemon.main`)."""

import sys

from kvscope.node.daemon import main

sys.exit(main())
