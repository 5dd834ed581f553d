// A Curator 5 contender driven line by line from stdin, for the interop tests: it holds
// Curator's own recipes while turnstile contends, and contends while turnstile holds.
//   acquire mutex|read|write|semmutex PATH TIMEOUT_MS      -> "acquired" | "timeout"
//   acquire semaphore PATH LIMIT TIMEOUT_MS                -> "acquired" | "timeout"
//   release                                                -> "released" (the latest hold)
//   quit
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.ArrayDeque;
import java.util.Deque;
import java.util.concurrent.TimeUnit;
import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreMutex;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreV2;
import org.apache.curator.framework.recipes.locks.Lease;
import org.apache.curator.retry.RetryNTimes;

public class CuratorPeer {
  interface Hold { void release() throws Exception; }

  public static void main(String[] args) throws Exception {
    CuratorFramework client = CuratorFrameworkFactory.newClient(args[0], 10000, 5000, new RetryNTimes(3, 100));
    client.start();
    client.blockUntilConnected();
    Deque<Hold> holds = new ArrayDeque<>();
    BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
    System.out.println("ready");
    System.out.flush();
    for (String line; (line = in.readLine()) != null;) {
      String[] word = line.trim().split(" ");
      if (word[0].equals("quit")) break;
      if (word[0].equals("release")) {
        holds.pop().release();
        System.out.println("released");
      } else if (word[0].equals("acquire")) {
        String kind = word[1];
        String path = word[2];
        Hold hold = null;
        if (kind.equals("semaphore")) {
          InterProcessSemaphoreV2 semaphore = new InterProcessSemaphoreV2(client, path, Integer.parseInt(word[3]));
          Lease lease = semaphore.acquire(Long.parseLong(word[4]), TimeUnit.MILLISECONDS);
          if (lease != null) hold = () -> semaphore.returnLease(lease);
        } else {
          long timeout = Long.parseLong(word[3]);
          final org.apache.curator.framework.recipes.locks.InterProcessLock lock;
          if (kind.equals("mutex")) lock = new InterProcessMutex(client, path);
          else if (kind.equals("semmutex")) lock = new InterProcessSemaphoreMutex(client, path);
          else if (kind.equals("read")) lock = new InterProcessReadWriteLock(client, path).readLock();
          else lock = new InterProcessReadWriteLock(client, path).writeLock();
          if (lock.acquire(timeout, TimeUnit.MILLISECONDS)) hold = lock::release;
        }
        if (hold != null) holds.push(hold);
        System.out.println(hold != null ? "acquired" : "timeout");
      }
      System.out.flush();
    }
    client.close();
  }
}
