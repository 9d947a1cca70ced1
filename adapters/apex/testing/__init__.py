"""``apex.testing``: the helpers Apex's own unit tests import (see :mod:`.common_utils`)."""
