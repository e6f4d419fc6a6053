/* ofl: intrusive lists as macros over the caller's own link fields, so that
 * a struct keeps its layout and may sit on several lists at once (an extent
 * is on the live list, the keep list and an I/O queue). Not installed.
 *
 * FIFO: a singly-linked list with head and tail pointers; push at the tail,
 * pop at the head, remove given the element before. DLIST: a doubly-linked
 * list with a head and, for the _TAIL forms, a tail pointer.
 *
 * The arguments are evaluated more than once: pass plain lvalues (d->head,
 * k->free_tail, e), never an expression with side effects, and never the
 * head itself as the element (take a copy first). No locking: the caller
 * holds whatever lock guards the list. Every removal clears the element's
 * links, so a removed element reads as on no list. */
#ifndef OFL_RUNTIME_QUEUE_H
#define OFL_RUNTIME_QUEUE_H

#include <stddef.h>

/* Appends elem at the tail. */
#define OFL_FIFO_PUSH(head, tail, elem, next)                                  \
  do {                                                                         \
    (elem)->next = NULL;                                                       \
    if ((tail) != NULL)                                                        \
      (tail)->next = (elem);                                                   \
    else                                                                       \
      (head) = (elem);                                                         \
    (tail) = (elem);                                                           \
  } while (0)

/* Takes the first element off a non-empty FIFO into out. */
#define OFL_FIFO_POP(head, tail, out, next)                                    \
  do {                                                                         \
    (out) = (head);                                                            \
    (head) = (out)->next;                                                      \
    if ((head) == NULL)                                                        \
      (tail) = NULL;                                                           \
    (out)->next = NULL;                                                        \
  } while (0)

/* Takes elem off the FIFO; prev is the element before it, NULL when elem
 * is the head (a variable of the element's type, not a NULL literal). */
#define OFL_FIFO_REMOVE(head, tail, prev, elem, next)                          \
  do {                                                                         \
    if ((prev) != NULL)                                                        \
      (prev)->next = (elem)->next;                                             \
    else                                                                       \
      (head) = (elem)->next;                                                   \
    if ((tail) == (elem))                                                      \
      (tail) = (prev);                                                         \
    (elem)->next = NULL;                                                       \
  } while (0)

/* Puts elem at the head of a doubly-linked list without a tail pointer. */
#define OFL_DLIST_PUSH_HEAD(head, elem, prev, next)                            \
  do {                                                                         \
    (elem)->prev = NULL;                                                       \
    (elem)->next = (head);                                                     \
    if ((head) != NULL)                                                        \
      (head)->prev = (elem);                                                   \
    (head) = (elem);                                                           \
  } while (0)

/* Takes elem off a doubly-linked list without a tail pointer. */
#define OFL_DLIST_UNLINK(head, elem, prev, next)                               \
  do {                                                                         \
    if ((elem)->prev != NULL)                                                  \
      (elem)->prev->next = (elem)->next;                                       \
    else                                                                       \
      (head) = (elem)->next;                                                   \
    if ((elem)->next != NULL)                                                  \
      (elem)->next->prev = (elem)->prev;                                       \
    (elem)->prev = (elem)->next = NULL;                                        \
  } while (0)

/* Appends elem at the tail of a doubly-linked list with a tail pointer. */
#define OFL_DLIST_PUSH_TAIL(head, tail, elem, prev, next)                      \
  do {                                                                         \
    (elem)->prev = (tail);                                                     \
    (elem)->next = NULL;                                                       \
    if ((tail) != NULL)                                                        \
      (tail)->next = (elem);                                                   \
    else                                                                       \
      (head) = (elem);                                                         \
    (tail) = (elem);                                                           \
  } while (0)

/* Takes elem off a doubly-linked list with a tail pointer. */
#define OFL_DLIST_UNLINK_TAIL(head, tail, elem, prev, next)                    \
  do {                                                                         \
    if ((elem)->prev != NULL)                                                  \
      (elem)->prev->next = (elem)->next;                                       \
    else                                                                       \
      (head) = (elem)->next;                                                   \
    if ((elem)->next != NULL)                                                  \
      (elem)->next->prev = (elem)->prev;                                       \
    else                                                                       \
      (tail) = (elem)->prev;                                                   \
    (elem)->prev = (elem)->next = NULL;                                        \
  } while (0)

#endif /* OFL_RUNTIME_QUEUE_H */
