// Curator's InterProcessMutex, uncontended acquire+release per second: the peer of
// bench/zookeeper_uncontended.cpp.   java -cp ... ZookeeperCuratorBench host:port [seconds]
import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.retry.RetryNTimes;

public class ZookeeperCuratorBench {
  public static void main(String[] args) throws Exception {
    double seconds = args.length > 1 ? Double.parseDouble(args[1]) : 5;
    CuratorFramework client = CuratorFrameworkFactory.newClient(args[0], 30000, 5000, new RetryNTimes(3, 100));
    client.start();
    client.blockUntilConnected();
    InterProcessMutex mutex = new InterProcessMutex(client, "/bench/zk-curator");
    for (int i = 0; i < 2000; ++i) { mutex.acquire(); mutex.release(); }  // warm up (JIT)
    long start = System.nanoTime();
    long count = 0;
    while ((System.nanoTime() - start) / 1e9 < seconds) { mutex.acquire(); mutex.release(); ++count; }
    System.out.printf("Curator InterProcessMutex acquire+release/s: %.0f%n", count / ((System.nanoTime() - start) / 1e9));
    client.close();
  }
}
