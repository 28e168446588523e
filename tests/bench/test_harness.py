from bench.harness import free_ports


def test_free_ports_never_hands_out_a_port_twice_in_one_process():
    # Two calls before either server binds (a mesh's ports, then an etcd's) must not share a port.
    first = free_ports(200)
    second = free_ports(200)
    assert len(set(first)) == 200 and len(set(second)) == 200
    assert not set(first) & set(second)
