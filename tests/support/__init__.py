"""Support shared by the whole suite: real servers, service threads, waiting, fakes."""
