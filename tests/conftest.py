import pytest

from tests.frontends import FRONTENDS


@pytest.fixture(params=sorted(FRONTENDS))
def frontend(request):
    return FRONTENDS[request.param]()
