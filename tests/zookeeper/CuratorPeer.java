// SPDX-License-Identifier: Apache-2.0
// A Curator 5 contender driven line by line from stdin, for the interop tests: it holds
// Curator's own recipes while turnstile contends, and contends while turnstile holds.
//   acquire mutex|read|write|semmutex PATH TIMEOUT_MS      -> "acquired" | "timeout"
//   acquire semaphore PATH LIMIT TIMEOUT_MS                -> "acquired" | "timeout"
//   release                                                -> "released" (the latest hold) | "not held"
//   release mutex|read|write|semmutex|semaphore PATH       -> "released" (the latest hold of that
//                                                             kind on PATH) | "not held"
//   latch start PATH ID                                    -> "started" (a LeaderLatch with
//                                                             that id; replaces PATH's latch)
//   latch await PATH MS                                    -> "leader" | "timeout"
//   latch has PATH                                         -> "true" | "false" (hasLeadership)
//   latch leader PATH                                      -> "leader <id>" | "none" (getLeader)
//   latch participants PATH                                -> the ids in order, space-separated
//   latch close PATH                                       -> "closed"
//   quit
// "read" and "write" on one PATH share one InterProcessReadWriteLock instance (kept per path),
// as one thread of one Java process would use it: so "acquire write P", "acquire read P",
// "release write P" is Curator's downgrade (the write holder's read is granted at once), and the
// read lock stays held until "release read P" (or "release").
import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.util.ArrayDeque;
import java.util.Deque;
import java.util.HashMap;
import java.util.Iterator;
import java.util.Map;
import java.util.concurrent.TimeUnit;
import org.apache.curator.framework.CuratorFramework;
import org.apache.curator.framework.CuratorFrameworkFactory;
import org.apache.curator.framework.recipes.leader.LeaderLatch;
import org.apache.curator.framework.recipes.leader.Participant;
import org.apache.curator.framework.recipes.locks.InterProcessMutex;
import org.apache.curator.framework.recipes.locks.InterProcessReadWriteLock;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreMutex;
import org.apache.curator.framework.recipes.locks.InterProcessSemaphoreV2;
import org.apache.curator.framework.recipes.locks.Lease;
import org.apache.curator.retry.RetryNTimes;

public class CuratorPeer {
  interface Hold { void release() throws Exception; }

  // One hold, with what "release KIND PATH" matches it by.
  static final class Held {
    final String kind;
    final String path;
    final Hold hold;
    Held(String kind, String path, Hold hold) { this.kind = kind; this.path = path; this.hold = hold; }
  }

  public static void main(String[] args) throws Exception {
    CuratorFramework client = CuratorFrameworkFactory.newClient(args[0], 10000, 5000, new RetryNTimes(3, 100));
    client.start();
    client.blockUntilConnected();
    Deque<Held> holds = new ArrayDeque<>();  // latest first
    Map<String, InterProcessReadWriteLock> readWriteLocks = new HashMap<>();
    Map<String, LeaderLatch> latches = new HashMap<>();
    BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
    System.out.println("ready");
    System.out.flush();
    for (String line; (line = in.readLine()) != null;) {
      String[] word = line.trim().split(" ");
      if (word[0].equals("quit")) break;
      if (word[0].equals("latch")) {
        System.out.println(latch(client, latches, word));
      } else if (word[0].equals("release") && word.length == 1) {
        Held latest = holds.poll();
        if (latest != null) latest.hold.release();
        System.out.println(latest != null ? "released" : "not held");
      } else if (word[0].equals("release")) {
        Held found = null;
        for (Iterator<Held> it = holds.iterator(); it.hasNext();) {
          Held held = it.next();
          if (held.kind.equals(word[1]) && held.path.equals(word[2])) {
            it.remove();
            found = held;
            break;
          }
        }
        if (found != null) found.hold.release();
        System.out.println(found != null ? "released" : "not held");
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
          else if (kind.equals("read")) lock = readWriteLocks.computeIfAbsent(path, p -> new InterProcessReadWriteLock(client, p)).readLock();
          else lock = readWriteLocks.computeIfAbsent(path, p -> new InterProcessReadWriteLock(client, p)).writeLock();
          if (lock.acquire(timeout, TimeUnit.MILLISECONDS)) hold = lock::release;
        }
        if (hold != null) holds.push(new Held(kind, path, hold));
        System.out.println(hold != null ? "acquired" : "timeout");
      }
      System.out.flush();
    }
    for (LeaderLatch latch : latches.values()) latch.close();
    client.close();
  }

  static String latch(CuratorFramework client, Map<String, LeaderLatch> latches, String[] word) throws Exception {
    String path = word[2];
    LeaderLatch latch = latches.get(path);
    switch (word[1]) {
      case "start":
        latch = new LeaderLatch(client, path, word[3]);
        latches.put(path, latch);
        latch.start();
        return "started";
      case "await":
        return latch.await(Long.parseLong(word[3]), TimeUnit.MILLISECONDS) ? "leader" : "timeout";
      case "has":
        return latch.hasLeadership() ? "true" : "false";
      case "leader":
        Participant leader = latch.getLeader();
        return leader.isLeader() ? "leader " + leader.getId() : "none";
      case "participants":
        StringBuilder ids = new StringBuilder();
        for (Participant participant : latch.getParticipants()) {
          if (ids.length() > 0) ids.append(' ');
          ids.append(participant.getId());
        }
        return ids.toString();
      case "close":
        latches.remove(path).close();
        return "closed";
      default:
        return "unknown latch command";
    }
  }
}
