// SPDX-License-Identifier: Apache-2.0
// Curator's InterProcessMutex, the peer of bench/zookeeper_uncontended.cpp (bench/zookeeper_run.sh
// runs both against one server and prints the tables).
//
//   java -cp ... ZookeeperCuratorBench uncontended host:port [seconds]
//     acquire+release per second on one client, and the requests the server received per pair
//     (mntr's zk_packets_received delta over the timed loop).
//   java -cp ... ZookeeperCuratorBench contention host:port [contenders] [seconds]
//     CONTENDERS clients (one session each, threads of this JVM rather than processes) loop
//     acquire / record / release on one InterProcessMutex; handoff = next holder's first instant
//     after acquire() returned - previous holder's last instant before release() (nanoTime, i.e.
//     CLOCK_MONOTONIC on Linux).
// Prints one JSON object.
import java.io.ByteArrayOutputStream;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.Socket;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.List;
import java.util.concurrent.CyclicBarrier;
import java.util.concurrent.atomic.AtomicInteger;
import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.RetryNTimes;

public class ZookeeperCuratorBench {
  static double mntr(String hostPort, String key) throws Exception {
    int colon = hostPort.lastIndexOf(':');
    try (Socket socket = new Socket(hostPort.substring(0, colon), Integer.parseInt(hostPort.substring(colon + 1)))) {
      OutputStream out = socket.getOutputStream();
      out.write("mntr".getBytes(StandardCharsets.US_ASCII));
      out.flush();
      InputStream in = socket.getInputStream();
      ByteArrayOutputStream text = new ByteArrayOutputStream();
      byte[] buffer = new byte[4096];
      for (int n; (n = in.read(buffer)) > 0;) text.write(buffer, 0, n);
      for (String line : text.toString(StandardCharsets.US_ASCII).split("\n")) {
        String[] parts = line.split("\t");
        if (parts.length == 2 && parts[0].equals(key)) return Double.parseDouble(parts[1].trim());
      }
    }
    return 0;
  }

  static CuratorFramework connect(String hostPort) throws Exception {
    CuratorFramework client = CuratorFrameworkFactory.newClient(hostPort, 30000, 5000, new RetryNTimes(3, 100));
    client.start();
    client.blockUntilConnected();
    return client;
  }

  static void uncontended(String hostPort, double seconds) throws Exception {
    CuratorFramework client = connect(hostPort);
    InterProcessMutex mutex = new InterProcessMutex(client, "/bench/zk-curator");
    long warm = System.nanoTime();  // warm up (JIT): 2000 pairs or 3 s
    for (int i = 0; i < 2000 && System.nanoTime() - warm < 3_000_000_000L; ++i) { mutex.acquire(); mutex.release(); }
    double packetsBefore = mntr(hostPort, "zk_packets_received");
    long start = System.nanoTime();
    long count = 0;
    while ((System.nanoTime() - start) / 1e9 < seconds) { mutex.acquire(); mutex.release(); ++count; }
    double elapsed = (System.nanoTime() - start) / 1e9;
    double packets = mntr(hostPort, "zk_packets_received") - packetsBefore;
    System.out.printf("{\"mode\":\"curator\",\"pairs\":%d,\"per_second\":%.1f,\"packets_per_pair\":%.3f}%n", count,
        count / elapsed, packets / count);
    client.close();
  }

  static long percentile(long[] sorted, double p) {
    if (sorted.length == 0) return 0;
    return sorted[(int) Math.round(p * (sorted.length - 1))];
  }

  static void contention(String hostPort, int contenders, double seconds) throws Exception {
    final int capacity = 1 << 22;
    final long[] starts = new long[capacity];
    final long[] ends = new long[capacity];
    final int[] who = new int[capacity];
    final AtomicInteger next = new AtomicInteger();
    final long[] period = new long[2];
    final CyclicBarrier ready = new CyclicBarrier(contenders + 1);
    final CyclicBarrier go = new CyclicBarrier(contenders + 1);
    List<Thread> threads = new ArrayList<>();
    List<CuratorFramework> clients = new ArrayList<>();
    for (int t = 0; t < contenders; ++t) {
      final int id = t;
      final CuratorFramework client = connect(hostPort);
      clients.add(client);
      Thread thread = new Thread(() -> {
        try {
          InterProcessMutex mutex = new InterProcessMutex(client, "/bench/contended-curator");
          for (int i = 0; i < 50; ++i) { mutex.acquire(); mutex.release(); }  // warm up (JIT), together
          ready.await();
          go.await();
          long end = period[1];
          for (;;) {
            mutex.acquire();
            long start = System.nanoTime();
            int i = next.getAndIncrement();
            boolean more = i < capacity && start < end;
            if (i < capacity) { starts[i] = start; who[i] = id; ends[i] = System.nanoTime(); }
            mutex.release();
            if (!more) break;
          }
        } catch (Exception e) {
          e.printStackTrace();
          System.exit(1);
        }
      });
      thread.start();
      threads.add(thread);
    }
    ready.await();
    period[0] = System.nanoTime();
    period[1] = period[0] + (long) (seconds * 1e9);
    go.await();
    for (Thread thread : threads) thread.join();
    for (CuratorFramework client : clients) client.close();
    int total = Math.min(next.get(), capacity);
    int n = 0;
    while (n < total && starts[n] < period[1]) ++n;
    long[] handoff = new long[Math.max(0, n - 1)];
    long[] cross = new long[handoff.length];
    int crossCount = 0, same = 0, errors = 0;
    for (int i = 0; i + 1 < n; ++i) {
      long h = starts[i + 1] - ends[i];
      handoff[i] = h;
      if (h < 0) ++errors;
      if (who[i + 1] == who[i]) ++same; else cross[crossCount++] = h;
    }
    Arrays.sort(handoff);
    cross = Arrays.copyOf(cross, crossCount);
    Arrays.sort(cross);
    double elapsed = (period[1] - period[0]) / 1e9;
    System.out.printf("{\"mode\":\"curator\",\"backend\":\"zk\",\"procs\":%d,\"seconds\":%.3f,\"acquisitions\":%d,"
        + "\"per_second\":%.1f,\"handoff_p50_ns\":%d,\"handoff_p99_ns\":%d,\"cross_p50_ns\":%d,\"cross_p99_ns\":%d,"
        + "\"same_process_share\":%.4f,\"order_errors\":%d,\"failed\":0}%n",
        contenders, elapsed, n, n / elapsed, percentile(handoff, 0.5), percentile(handoff, 0.99),
        percentile(cross, 0.5), percentile(cross, 0.99), handoff.length == 0 ? 0.0 : (double) same / handoff.length,
        errors);
  }

  public static void main(String[] args) throws Exception {
    String mode = args.length > 0 ? args[0] : "";
    if (mode.equals("uncontended") && args.length >= 2) {
      uncontended(args[1], args.length > 2 ? Double.parseDouble(args[2]) : 5);
    } else if (mode.equals("contention") && args.length >= 2) {
      contention(args[1], args.length > 2 ? Integer.parseInt(args[2]) : 8, args.length > 3 ? Double.parseDouble(args[3]) : 2);
    } else {
      System.err.println("usage: ZookeeperCuratorBench uncontended host:port [seconds]\n"
          + "       ZookeeperCuratorBench contention host:port [contenders] [seconds]");
      System.exit(64);
    }
    System.exit(0);
  }
}
