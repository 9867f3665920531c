"""Which connection gives way when the metrics endpoint is at a cap (agent/daemon/http_guard.py), and the pace of
accept(): pure decisions, tested on their own; the endpoint under real clients is tests/test_endpoint_abuse.py."""
from __future__ import annotations

import socket

import pytest
from gpuwarden.agent.daemon.http_guard import AcceptPace, Admission, client_key


class Conn:
    def __init__(self, address, since, rank=0):
        self.address, self.since, self._rank = address, since, rank

    @property
    def rank(self):
        return self._rank

    def __repr__(self):
        return f"Conn({self.address!r}, {self.since}, {self._rank})"


def admitted(adm: Admission, *conns: Conn) -> list[Conn]:
    for c in conns:
        adm.add(c)
    return list(conns)


def test_room_left_takes_a_new_connection_and_sheds_nothing():
    adm = Admission(total=4, per_address=2)
    admitted(adm, Conn("a", 1.0))
    assert adm.admit("a") == (True, None) and adm.admit("b") == (True, None)


def test_an_address_at_its_cap_gives_way_to_itself_first_its_oldest_waiting_connection():
    adm = Admission(total=10, per_address=3)
    old, mid, new = admitted(adm, Conn("a", 1.0), Conn("a", 2.0), Conn("a", 3.0))
    admitted(adm, Conn("b", 0.5))  # older, but another address: not what a's new connection displaces
    assert adm.admit("a") == (True, old)
    old._rank = None  # now being answered: never shed
    assert adm.admit("a") == (True, mid)


def test_a_connection_writing_a_response_gives_way_only_after_every_waiting_one():
    adm = Admission(total=3, per_address=3)
    writing, waiting, _ = admitted(adm, Conn("a", 1.0, rank=1), Conn("a", 5.0), Conn("b", 6.0))
    assert adm.admit("c") == (True, waiting)


def test_at_the_total_cap_the_address_holding_most_pays_its_oldest():
    adm = Admission(total=4, per_address=4)
    b_old = Conn("b", 2.0)
    admitted(adm, Conn("a", 1.0), b_old, Conn("b", 3.0), Conn("b", 4.0))
    assert adm.admit("c") == (True, b_old)


def test_when_every_connection_is_being_answered_the_new_one_is_refused():
    adm = Admission(total=2, per_address=2)
    admitted(adm, Conn("a", 1.0, rank=None), Conn("b", 2.0, rank=None))
    assert adm.admit("c") == (False, None)
    assert adm.admit("a") == (False, None)


def test_removing_keeps_the_counts_and_a_connection_removed_twice_counts_once():
    adm = Admission(total=2, per_address=1)
    (c,) = admitted(adm, Conn("a", 1.0))
    adm.remove(c)
    adm.remove(c)
    assert len(adm) == 0 and adm.admit("a") == (True, None)


@pytest.mark.parametrize("peer, key", [
    (("10.0.0.7", 51000), "10.0.0.7"),
    (("::ffff:10.0.0.7", 51000, 0, 0), "10.0.0.7"),  # IPv4-mapped on an IPv6 listener: the same client
    (("2001:db8:1:2::5", 51000, 0, 0), socket.inet_pton(socket.AF_INET6, "2001:db8:1:2::")[:8]),
    (("2001:db8:1:2:ffff::9%eth0", 51000, 0, 2), socket.inet_pton(socket.AF_INET6, "2001:db8:1:2::")[:8]),
])
def test_a_client_is_its_ipv4_address_or_its_ipv6_64(peer, key):
    assert client_key(peer) == key


def test_accept_is_paced_past_its_burst_and_refills_to_a_batch():
    pace = AcceptPace(per_s=100.0, burst=4, batch=2)
    assert [pace.take(10.0) for _ in range(4)] == [0.0] * 4
    wait = pace.take(10.0)
    assert wait == pytest.approx(2 / 100.0)  # it waits for a batch's worth, not for one token
    later = 10.0 + wait + 1e-9
    assert pace.take(later) == 0.0 and pace.take(later) == 0.0 and pace.take(later) > 0
