/* The guest of scripts/pvm-cost/run.sh: one phase per kind of event, N of each. */
    .code64
    .globl _start
/* Phases, each N iterations, separated by `out` to 0xf0 with the phase id (the runner
 * reads its thread CPU clock at each). */
#define N 2000
_start:
    lidt idtr(%rip)
    mov $0x30, %ax; ltr %ax
    mov $1, %eax; out %eax, $0xf0
    /* 1: CPL0 emulated loop: 3 instructions per iteration */
    mov $N, %ecx
1:  nop; dec %ecx; jnz 1b
    mov $2, %eax; out %eax, $0xf0
    /* 2: CPL0 PIO exit */
    mov $N, %ecx
1:  out %al, $0xf1; dec %ecx; jnz 1b
    mov $3, %eax; out %eax, $0xf0
    /* 3: CPL0 MMIO write exit */
    mov $N, %ecx; mov $0xd0000000, %rbx
1:  movl %eax, (%rbx); dec %ecx; jnz 1b
    mov $12, %eax; out %eax, $0xf0
    /* 12: CPL0 MMIO write KVM coalesces (a page the runner registered), 100 per
     * batch, then a PIO exit at which the runner drains the ring: 20 batches */
    mov $20, %edx; mov $0xd0001000, %rbx
2:  mov $100, %ecx
1:  movl %eax, (%rbx); dec %ecx; jnz 1b
    out %al, $0xf1; dec %edx; jnz 2b
    mov $13, %eax; out %eax, $0xf0
    /* 13: CPL0 MMIO write to an ioeventfd (signalled in the kernel, no exit) */
    mov $N, %ecx; mov $0xd0002000, %rbx
1:  movl %eax, (%rbx); dec %ecx; jnz 1b
    mov $14, %eax; out %eax, $0xf0
    /* 14: CPL0 write to the in-kernel LAPIC (task priority register) */
    mov $N, %ecx; mov $0xfee00080, %rbx; xor %eax, %eax
1:  movl %eax, (%rbx); dec %ecx; jnz 1b
    mov $4, %eax; out %eax, $0xf0
    /* to CPL3 */
    pushq $0x23; pushq $0x70000; pushq $0x3202; pushq $0x2b
    lea user(%rip), %rax; pushq %rax
    iretq
user:
    mov $5, %eax; out %eax, $0xf0
    /* 5: CPL3 native loop (N*1000 iterations) */
    mov $N*1000, %ecx
1:  nop; dec %ecx; jnz 1b
    mov $6, %eax; out %eax, $0xf0
    /* 6: CPL3 PIO exit */
    mov $N, %ecx
1:  out %al, $0xf1; dec %ecx; jnz 1b
    mov $7, %eax; out %eax, $0xf0
    /* 7: CPL3 MMIO write exit */
    mov $N, %ecx; mov $0xd0000000, %rbx
1:  movl %eax, (%rbx); dec %ecx; jnz 1b
    mov $8, %eax; out %eax, $0xf0
    /* 8: CPL3 -> CPL0 -> CPL3 round trip (ud2, the handler skips it) */
    mov $N, %ecx
1:  ud2; dec %ecx; jnz 1b
    mov $9, %eax; out %eax, $0xf0
    /* 9: CPL3 first touch of N distinct pages (from 1 MiB) */
    mov $N, %ecx; mov $0x100000, %rbx
1:  movl (%rbx), %eax; add $4096, %rbx; dec %ecx; jnz 1b
    mov $10, %eax; out %eax, $0xf0
    /* 10: CPL3 second touch of the same pages */
    mov $N, %ecx; mov $0x100000, %rbx
1:  movl (%rbx), %eax; add $4096, %rbx; dec %ecx; jnz 1b
    mov $11, %eax; out %eax, $0xf0
    mov $0xdddd, %eax; out %eax, $0xf0
2:  jmp 2b

h_ud:
    addq $2, (%rsp); iretq
h_other:
    mov $0x1ff, %eax; out %eax, $0xf0
    mov (%rsp), %eax; out %eax, $0xf0
    mov 8(%rsp), %eax; out %eax, $0xf0
4:  jmp 4b

    .balign 8
idtr: .word 256*16-1
      .quad 0x4000
    .globl off_ud, off_other
    .set off_ud, h_ud - _start
    .set off_other, h_other - _start
