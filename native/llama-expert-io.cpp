// llamapack expert read pool: preads into caller memory on native threads (see llama-expert.h).
//
// Python's read threads took the GIL around every read they ran, and the compute thread's provider call
// waited for it (measured: ~28 ms per token with lookahead reads in flight). These threads never touch
// Python: the provider queues reads, and waits for them with the GIL released (cffi releases it).

#include "llama-expert.h"

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

#include <unistd.h>

namespace {

struct read_job {
    int       fd;
    char *    dst;
    uint64_t  offset;
    uint64_t  nbytes;
    uint64_t  align;
    bool      prefetch;
    bool      released = false;
    int32_t   state    = LLAMA_EXPERT_READ_QUEUED;
    int32_t   error    = 0;
    uint64_t  bytes    = 0;
    uint64_t  order    = 0;  // 1 for the first read the pool started, 2 for the next, ...
};

bool is_finished(int32_t state) {
    return state >= LLAMA_EXPERT_READ_DONE;
}

struct read_result {
    int32_t  error = 0;
    uint64_t bytes = 0;
};

// pread until nbytes, the end of the file, an error, or a read ending off `align`
read_result run_read(const read_job & job) {
    read_result result;
    while (result.bytes < job.nbytes) {
        const ssize_t n = pread(job.fd, job.dst + result.bytes, job.nbytes - result.bytes,
                                (off_t) (job.offset + result.bytes));
        if (n < 0) {
            if (errno == EINTR) {
                continue;
            }
            result.error = errno;
            break;
        }
        if (n == 0) {
            break;
        }
        result.bytes += (uint64_t) n;
        if (job.align && result.bytes % job.align) {
            break;  // O_DIRECT: only the end of the file ends a read off the block size
        }
    }
    return result;
}

} // namespace

struct llama_expert_read_pool {
    std::mutex                              mutex;
    std::condition_variable                 work;      // a read was queued, or a prefetch read may start
    std::condition_variable                 finished;  // a read finished
    std::deque<int64_t>                     demand;
    std::deque<int64_t>                     prefetch;
    std::unordered_map<int64_t, read_job>   jobs;
    std::vector<std::thread>                threads;
    int64_t                                 next_id          = 1;
    uint64_t                                started          = 0;
    bool                                    holding          = false;
    int32_t                                 max_prefetch     = 0;
    int32_t                                 running_demand   = 0;
    int32_t                                 running_prefetch = 0;
    bool                                    closing          = false;

    // the next read by priority, waiting for one; 0 when the pool closes. Holds the lock.
    int64_t next_job(std::unique_lock<std::mutex> & lock) {
        for (;;) {
            if (closing) {
                return 0;
            }
            if (holding) {
                work.wait(lock);
                continue;
            }
            if (!demand.empty()) {
                const int64_t id = demand.front();
                demand.pop_front();
                running_demand++;
                return id;
            }
            if (!prefetch.empty() && running_prefetch < max_prefetch && running_demand == 0) {
                const int64_t id = prefetch.front();
                prefetch.pop_front();
                running_prefetch++;
                return id;
            }
            work.wait(lock);
        }
    }

    void worker() {
        std::unique_lock<std::mutex> lock(mutex);
        while (const int64_t id = next_job(lock)) {
            read_job & job = jobs.at(id);  // node-based map: the reference survives inserts elsewhere
            job.state = LLAMA_EXPERT_READ_RUNNING;
            job.order = ++started;
            const read_job request = job;  // read without the lock from a copy; results go back under it
            lock.unlock();
            const read_result result = run_read(request);
            lock.lock();
            job.error = result.error;
            job.bytes = result.bytes;
            job.state = result.error ? LLAMA_EXPERT_READ_FAILED : LLAMA_EXPERT_READ_DONE;
            if (job.released) {
                jobs.erase(id);
            }
            (request.prefetch ? running_prefetch : running_demand)--;
            finished.notify_all();
            if (!prefetch.empty()) {
                work.notify_all();  // a prefetch read may start now
            }
        }
    }

    void cancel_queued(std::deque<int64_t> & queue) {
        for (const int64_t id : queue) {
            jobs.at(id).state = LLAMA_EXPERT_READ_CANCELLED;
        }
        queue.clear();
    }

    // remove id from queue; true when it was there
    static bool unqueue(std::deque<int64_t> & queue, int64_t id) {
        for (auto it = queue.begin(); it != queue.end(); ++it) {
            if (*it == id) {
                queue.erase(it);
                return true;
            }
        }
        return false;
    }
};

struct llama_expert_read_pool * llama_expert_read_pool_new(int32_t n_threads, int32_t max_prefetch) {
    if (n_threads < 1 || max_prefetch < 0 || max_prefetch >= n_threads) {
        return nullptr;
    }
    auto * pool = new llama_expert_read_pool();
    pool->max_prefetch = max_prefetch;
    try {
        for (int32_t i = 0; i < n_threads; i++) {
            pool->threads.emplace_back([pool] { pool->worker(); });
        }
    } catch (const std::system_error &) {
        llama_expert_read_pool_free(pool);
        return nullptr;
    }
    return pool;
}

void llama_expert_read_pool_free(struct llama_expert_read_pool * pool) {
    if (pool == nullptr) {
        return;
    }
    {
        std::lock_guard<std::mutex> lock(pool->mutex);
        pool->closing = true;
        pool->cancel_queued(pool->demand);
        pool->cancel_queued(pool->prefetch);
        pool->work.notify_all();
    }
    for (auto & thread : pool->threads) {
        thread.join();  // a running read finishes first
    }
    delete pool;
}

int64_t llama_expert_read_submit(struct llama_expert_read_pool * pool, int32_t fd, void * dst,
        uint64_t offset, uint64_t nbytes, uint64_t align, bool prefetch) {
    std::lock_guard<std::mutex> lock(pool->mutex);
    if (pool->closing) {
        return -1;
    }
    const int64_t id = pool->next_id++;
    read_job job;
    job.fd = fd;
    job.dst = static_cast<char *>(dst);
    job.offset = offset;
    job.nbytes = nbytes;
    job.align = align;
    job.prefetch = prefetch;
    pool->jobs.emplace(id, job);
    (prefetch ? pool->prefetch : pool->demand).push_back(id);
    pool->work.notify_one();
    return id;
}

int32_t llama_expert_read_promote(struct llama_expert_read_pool * pool, int64_t id) {
    std::lock_guard<std::mutex> lock(pool->mutex);
    if (!llama_expert_read_pool::unqueue(pool->prefetch, id)) {
        return 0;
    }
    pool->jobs.at(id).prefetch = false;  // it runs, and is counted, as a demand read
    pool->demand.push_back(id);
    pool->work.notify_one();
    return 1;
}

int32_t llama_expert_read_cancel(struct llama_expert_read_pool * pool, int64_t id) {
    std::lock_guard<std::mutex> lock(pool->mutex);
    if (!llama_expert_read_pool::unqueue(pool->prefetch, id) && !llama_expert_read_pool::unqueue(pool->demand, id)) {
        return 0;
    }
    pool->jobs.at(id).state = LLAMA_EXPERT_READ_CANCELLED;
    pool->finished.notify_all();
    return 1;
}

int32_t llama_expert_read_get_status(struct llama_expert_read_pool * pool, int64_t id,
        struct llama_expert_read_status * out) {
    std::lock_guard<std::mutex> lock(pool->mutex);
    const auto it = pool->jobs.find(id);
    if (it == pool->jobs.end()) {
        return -1;
    }
    out->state = it->second.state;
    out->error = it->second.error;
    out->bytes = it->second.bytes;
    out->order = it->second.order;
    return 0;
}

int32_t llama_expert_read_wait_any(struct llama_expert_read_pool * pool, const int64_t * ids, int32_t n_ids,
        double timeout_s) {
    std::unique_lock<std::mutex> lock(pool->mutex);
    const auto count_finished = [&] {
        int32_t n = 0;
        for (int32_t i = 0; i < n_ids; i++) {
            const auto it = pool->jobs.find(ids[i]);
            n += it == pool->jobs.end() || is_finished(it->second.state);
        }
        return n;
    };
    if (n_ids <= 0) {
        return 0;
    }
    if (timeout_s < 0) {
        pool->finished.wait(lock, [&] { return count_finished() > 0; });
    } else {
        pool->finished.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return count_finished() > 0; });
    }
    return count_finished();
}

void llama_expert_read_pool_hold(struct llama_expert_read_pool * pool, bool hold) {
    std::lock_guard<std::mutex> lock(pool->mutex);
    pool->holding = hold;
    if (!hold) {
        pool->work.notify_all();
    }
}

void llama_expert_read_release(struct llama_expert_read_pool * pool, int64_t id) {
    std::lock_guard<std::mutex> lock(pool->mutex);
    const auto it = pool->jobs.find(id);
    if (it == pool->jobs.end()) {
        return;
    }
    if (it->second.state == LLAMA_EXPERT_READ_RUNNING) {
        it->second.released = true;  // the worker erases it when the read ends
        return;
    }
    if (!llama_expert_read_pool::unqueue(pool->prefetch, id)) {
        llama_expert_read_pool::unqueue(pool->demand, id);
    }
    pool->jobs.erase(it);
}
